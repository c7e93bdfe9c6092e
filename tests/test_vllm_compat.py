"""Every vLLM name ds4-vllm patches or relies on exists in the installed vLLM, and the
version dispatch picks the right compat module. Fails loudly when a vLLM upgrade removes one."""

import logging
import sys
import types

import pytest

vllm = pytest.importorskip("vllm")

from ds4_vllm import vllm_compat  # noqa: E402
from ds4_vllm.vllm_compat import module_name_for, release_of, resolve_name  # noqa: E402

INSTALLED = vllm_compat.compat_module()
CHECKED_NAMES = [*INSTALLED.PATCHED_NAMES, *INSTALLED.PUBLIC_NAMES]


def test_installed_vllm_is_a_tested_release() -> None:
    name, tested = module_name_for(vllm.__version__)
    assert tested, f"vLLM {vllm.__version__} has no compat module; add one to TESTED_RELEASES"
    assert name == INSTALLED.__name__


@pytest.mark.parametrize("dotted", CHECKED_NAMES)
def test_name_exists_in_installed_vllm(dotted: str) -> None:
    resolve_name(dotted)  # raises ImportError / AttributeError when vLLM no longer has it


def test_every_patched_name_says_why() -> None:
    assert all(why.strip() for why in INSTALLED.PATCHED_NAMES.values())


def test_vllm_serve_loads_plugins_while_building_its_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sys.argv rewrite works only because plugins load before `vllm serve` parses argv."""
    from vllm.engine import arg_utils
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    calls: list[str] = []
    monkeypatch.setattr(arg_utils, "load_general_plugins", lambda: calls.append("plugins"))
    arg_utils.AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    assert calls == ["plugins"]


def test_vllm_parser_reads_sys_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    parser.add_argument("--kv-transfer-config")
    monkeypatch.setattr(sys, "argv", ["vllm", "--kv-transfer-config", "{}"])
    assert parser.parse_args().kv_transfer_config == "{}"


@pytest.mark.parametrize(
    ("version", "release"),
    [("0.32.0", (0, 32)), ("0.32.3+cpu", (0, 32)), ("0.33.0rc1", (0, 33)), ("1.0", (1, 0)), ("dev", None)],
)
def test_release_of(version: str, release: tuple[int, int] | None) -> None:
    assert release_of(version) == release


@pytest.mark.parametrize(
    ("version", "module", "tested"),
    [
        ("0.32.0", "v0_32", True),
        ("0.32.4+cu130", "v0_32", True),
        ("0.33.0", "v0_32", False),  # newer: the newest tested module not newer than it
        ("0.31.0", "v0_32", False),  # older than all: the oldest tested module
        ("dev", "v0_32", False),
    ],
)
def test_dispatch(version: str, module: str, tested: bool) -> None:
    assert module_name_for(version) == (f"ds4_vllm.vllm_compat.{module}", tested)


def test_untested_release_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="ds4_vllm.vllm_compat"):
        assert vllm_compat.compat_module("0.99.0") is INSTALLED
    assert "vLLM 0.99.0 is not" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ds4_vllm.vllm_compat"):
        vllm_compat.compat_module("0.32.1")
    assert caplog.text == ""


def test_missing_patched_name_stops_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    def apply() -> None:
        raise AttributeError("module 'vllm.engine.arg_utils' has no attribute 'get_model_path'")

    monkeypatch.setattr(vllm_compat, "compat_module", lambda version=None: types.SimpleNamespace(apply=apply))
    with pytest.raises(vllm_compat.VllmCompatError, match=r"get_model_path.*tested with vLLM 0\.32\.x"):
        vllm_compat.apply()


def test_resolve_name_reports_missing_attribute() -> None:
    with pytest.raises(AttributeError):
        resolve_name("vllm.engine.arg_utils.EngineArgs.no_such_method")
    with pytest.raises(ModuleNotFoundError):
        resolve_name("no_such_package_ds4.x")
