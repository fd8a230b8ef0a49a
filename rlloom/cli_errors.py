"""How `rlloom` ends on a failure a user caused or can fix: one line naming the problem and the
fix, and an exit code that says which kind (2: bad input or user code, 3: the run diverged,
1: a file could not be written, 130/143: interrupted), never a traceback."""
from __future__ import annotations

import errno
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from rlloom.config import ConfigError
from rlloom.data.row_files import DataError
from rlloom.models.config import CheckpointError, UnsupportedArchitectureError
from rlloom.runtime.outputs.files import nearest_existing
from rlloom.runtime.stages.nonfinite import NonFiniteStop
from rlloom.runtime.stop_signals import Stopped
from rlloom.user_code import UserCodeError

USER_ERRORS = (ConfigError, DataError, CheckpointError, UnsupportedArchitectureError,
               UserCodeError)
# a full disk, a quota, a read-only or unwritable run directory: one line, no traceback
_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


def _free_space(path: Path) -> str:
    """How much the filesystem holding `path` has free."""
    usage = shutil.disk_usage(nearest_existing(path))
    return f"{usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB there"


def reporting_errors(run: Callable[[], None], command: str, report: bool) -> None:
    """`run()`, ending the process as the module says on what it raises; `report`: the
    command's output is only a report (a closed pipe ends it quietly)."""
    try:
        run()
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except NonFiniteStop as e:  # the run diverged (train.on_nonfinite=stop)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(3)
    except Stopped as e:  # SIGINT / SIGTERM, after a checkpoint
        print(str(e), file=sys.stderr)
        sys.exit(e.code)
    except KeyboardInterrupt:  # Ctrl-C outside a run's steps (its start, its end, sft, eval)
        print(f"interrupted: {command} stopped before it finished; what it writes is written "
              "whole or not at all, so nothing half-written is left (a run goes on from its "
              "last checkpoint with rlloom train --resume RUN_DIR)", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:
        if not report:
            raise
        # `rlloom plan --json | head`: the reader has all it wants
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    except OSError as e:
        if e.errno not in _WRITE_ERRNOS or not e.filename:
            raise
        print(f"error: cannot write {e.filename}: {e.strerror} "
              f"({_free_space(Path(e.filename))}); free space or choose another path, then "
              "go on (a run: rlloom train --resume RUN_DIR from its last checkpoint)",
              file=sys.stderr)
        sys.exit(1)
