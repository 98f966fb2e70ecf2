"""``import miles_core`` stays light: no torch, no engine, no plugin, no device."""

import subprocess
import sys

HEAVY = (
    "torch",
    "ray",
    "transformers",
    "sglang",
    "megatron",
    "nixl",
    "diffusers",
    "numpy",
    "peft",
    "miles_algorithms",
)


def test_import_miles_core_imports_nothing_heavy():
    code = (
        "import sys, miles_core, miles_core.config, miles_core.plugins, miles_core.cli\n"
        f"heavy = [m for m in sys.modules if m.split('.')[0] in {HEAVY!r}]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"import miles_core pulled in: {out.stdout.strip()}"
