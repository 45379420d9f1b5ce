"""DeepSpeed's runner (``deepspeed.launcher.runner``) as deepy.py starts it locally, with one-line errors.

Run by file path (``python .../ds_runner.py RUNNER_ARGS...``) so it needs nothing but DeepSpeed: the runner's own
resource errors (a bad include/exclude, no devices) become ``deepy.py: error: launcher: ...`` and exit status 2
instead of a traceback; everything else is the runner's behaviour, exit status included.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    """Run DeepSpeed's runner on ``argv``; returns its exit status."""
    from deepspeed.launcher import runner

    try:
        runner.main(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    except (ValueError, RuntimeError) as e:  # bad resources, unreachable hosts
        print(f"deepy.py: error: launcher: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
