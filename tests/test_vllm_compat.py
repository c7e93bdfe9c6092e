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


def test_runner_still_rewinds_discarded_rows_with_set_offset() -> None:
    """Item 8 of v0_32 works around exactly this code: if vLLM changes it, revisit the patch."""
    import inspect

    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler, random_sample
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    bookkeeping = inspect.getsource(GPUModelRunner._bookkeeping_sync)
    assert "self.discard_request_mask.np[:num_reqs]" in bookkeeping
    assert "self.input_batch.generators.get(int(i))" in bookkeeping
    assert "gen.set_offset(gen.get_offset() - 4)" in bookkeeping
    assert "self._bookkeeping_sync(" in inspect.getsource(GPUModelRunner.sample_tokens)
    # The samplers draw per-request noise only for the rows present in `generators`.
    for sampler in (random_sample, TopKTopPSampler.forward_cpu):
        assert "generators.items()" in inspect.getsource(sampler)
    with pytest.raises(RuntimeError, match="offset"):
        import torch

        torch.Generator().set_offset(0)  # why the rewind cannot run on the CPU


def test_discarded_rows_lend_out_their_generators() -> None:
    """Rows whose token is thrown away sample without their generator; the others keep theirs."""
    import numpy as np
    import torch

    kept, partial = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    runner = types.SimpleNamespace(
        execute_model_state=object(),
        discard_request_mask=types.SimpleNamespace(np=np.array([False, True, True, True])),
        input_batch=types.SimpleNamespace(num_reqs=3, generators={0: kept, 1: partial}),
    )
    assert INSTALLED._take_discarded_generators(runner) == {1: partial}
    assert runner.input_batch.generators == {0: kept}
    runner.execute_model_state = None  # no step in flight: nothing is sampled, nothing taken
    assert INSTALLED._take_discarded_generators(runner) == {}


def test_sample_tokens_is_wrapped_once_the_plugin_loads() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    INSTALLED.apply()
    assert getattr(GPUModelRunner.sample_tokens, "_ds4_patched", False)
