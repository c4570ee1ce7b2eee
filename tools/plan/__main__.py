"""`python -m tools.plan --world-size W [...]` picks the actor/critic split of a world
(tools/plan/split.py); `python -m tools.plan --memory [...]` predicts each rank's peak memory
instead (tools/plan/memory.py). One command for both, as the docs have always named them.
"""

from __future__ import annotations

import sys

from tools.plan import memory, split


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--memory" in argv:
        return memory.main([a for a in argv if a != "--memory"])
    return split.main(argv)


if __name__ == "__main__":
    sys.exit(main())
