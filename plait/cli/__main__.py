"""`python -m plait.cli`: the `plait` command (plait/cli/main.py), and the hidden
`_torchrun` child through which plait train's launcher runs torch.distributed.run quietly
(plait/launch/local.py)."""

import os
import sys

from plait.cli.main import main

if __name__ == "__main__":
    hidden = sys.argv[1:2] and sys.argv[1].startswith("_")  # no command starts with _
    if hidden:
        from plait.launch.local import TORCHRUN_COMMAND, run_torchrun
    if hidden and sys.argv[1] == TORCHRUN_COMMAND:  # the launcher's child
        code = run_torchrun(sys.argv[2:])
    else:
        code = main()
    # Nothing is left to clean up: skip the interpreter's teardown of torch, which takes
    # seconds on a loaded machine, so that a stopped run ends when its ranks have.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
