"""Launch torchtitan's trainer with Lins: ``python -m lins_dtensor.train --job.config_file X.toml``.

Same arguments as ``torchtitan.train`` (``--section.key value`` overrides the TOML);
works under ``torchrun`` and, for one process, without it. On a machine without a
GPU it installs the CPU/gloo shims (:mod:`lins_dtensor.integrations.torchtitan.cpu`)
first. Hub access is off (``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE``) unless the
environment says otherwise. A wrong ``[lins]`` value ends the run with one line
``lins: error: ...`` on stderr and exit status 2.
"""

from __future__ import annotations

import os
import socket
import sys


def single_process_env() -> None:
    """Let ``python -m lins_dtensor.train`` run as a world of one without torchrun."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    defaults = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for key, value in defaults.items():
        os.environ.setdefault(key, value)


def main() -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    single_process_env()

    # Imported only now, after the environment above is set (torchtitan and Hugging
    # Face read it at import): registers the lins_llama3 TrainSpec and dataset, and
    # patches torchtitan for CPU.
    # isort: off  (Lins' registration first; its CPU shims patch torchtitan's modules
    # whether or not they were imported before, e.g. by a test's preloading server)
    import lins_dtensor.integrations.torchtitan  # noqa: F401
    import torchtitan.train as titan_train
    # isort: on
    from lins_dtensor.integrations.torchtitan.trainer import LinsTrainer
    from lins_dtensor.errors import LinsError

    try:
        titan_train.main(LinsTrainer)  # parses sys.argv like torchtitan.train
    except LinsError as exc:
        print(f"lins: error: {exc.detail}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
