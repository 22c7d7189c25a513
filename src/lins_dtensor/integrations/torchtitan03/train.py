"""Launch torchtitan 0.3's trainer with Lins: ``python -m lins_dtensor.integrations.torchtitan03.train --config NAME``.

torchtitan's ``torchtitan.train`` with this package as ``--module`` (added when not
given) and the same ``--section.field value`` overrides; works under ``torchrun`` and,
for one process, without it. A wrong Lins setting ends the run with one line
``lins: error: ...`` on stderr and exit status 2 instead of torchtitan's traceback.
Hub access is off (``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE``) unless the environment
says otherwise.
"""

from __future__ import annotations

import os
import sys

MODULE = "lins_dtensor.integrations.torchtitan03"


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from lins_dtensor.train import single_process_env

    single_process_env()
    args = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--module" or a.startswith("--module=") for a in args):
        args = ["--module", MODULE, *args]
    sys.argv = [sys.argv[0], *args]

    # Imported only now, after the environment above is set (torchtitan and Hugging
    # Face read it at import); this package's shims patch torchtitan's modules
    # whether or not they were imported before.
    import torchtitan.train as titan_train

    import lins_dtensor.integrations.torchtitan03  # noqa: F401
    from lins_dtensor.errors import LinsError

    try:
        titan_train.main()  # parses sys.argv like torchtitan.train
    except LinsError as exc:
        print(f"lins: error: {exc.detail}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
