"""torchrun worker for test_torchrun.py's elastic restart: ``python -m ncclkv.scenario ARGS``, then rank 1 of
attempt 0 (TORCHELASTIC_RESTART_COUNT=0) exits 1 once its scenario is done, rendezvous keys and all written.

torchrun then stops the other workers and starts attempt 1 against the same agent store: the scenario must
pass there on keys of its own, not read attempt 0's stale addresses and outcome.
"""

from __future__ import annotations

import os
import sys

from ncclkv.scenario.__main__ import main

if __name__ == "__main__":
    rc = main(sys.argv[1:])
    attempt, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
    print(f"restart_once: rank {rank} attempt {attempt} scenario exit {rc}", flush=True)
    if attempt == "0" and rank == "1":
        sys.exit(1)  # an injected worker failure: torchrun restarts every worker
    sys.exit(rc)
