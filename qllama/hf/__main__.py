"""``python -m qllama.hf script.py [args...]``: run an unmodified transformers script with
:func:`qllama.hf.install` in effect, so its ``AutoModelForCausalLM.from_pretrained``,
``AutoTokenizer.from_pretrained`` and ``pipeline`` load ``.gguf`` paths through qllama.

``python -m qllama.hf -m package.module [args...]`` runs a module instead, as ``python -m``
does. The script sees ``sys.argv`` as if it had been started directly.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

USAGE = (
    "usage: python -m qllama.hf script.py [args...]\n"
    "       python -m qllama.hf -m module [args...]\n"
    "Runs the script with transformers' AutoModelForCausalLM.from_pretrained,\n"
    "AutoTokenizer.from_pretrained and pipeline loading .gguf files through qllama\n"
    "(qllama.hf.install(); docs/transformers.md)."
)


def main(argv: Sequence[str] | None = None) -> int:
    """Install the patches, then run the script or module named in ``argv``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not args else sys.stdout)
        return 2 if not args else 0
    from qllama.hf import install

    install()
    if args[0] == "-m":
        if len(args) < 2:
            print(USAGE, file=sys.stderr)
            return 2
        sys.argv = [args[1], *args[2:]]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        return 0
    script = args[0]
    if not os.path.isfile(script):
        print(f"python -m qllama.hf: no script {script!r}\n{USAGE}", file=sys.stderr)
        return 2
    sys.argv = [script, *args[1:]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
