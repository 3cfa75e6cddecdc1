"""``import ncclkv`` needs only the runtime dependencies: nothing optional is imported on the way."""

from __future__ import annotations

import json
import subprocess
import sys

OPTIONAL = ("vllm", "mpi4py", "hypothesis", "pytest", "rich", "matplotlib", "transformers", "nvidia")


def test_import_ncclkv_pulls_no_optional_package() -> None:
    code = (
        "import json, sys; import ncclkv, ncclkv.engine, ncclkv.layout, ncclkv.paged, ncclkv.buffer, "
        "ncclkv.hashing, ncclkv.channel, ncclkv.transport, ncclkv.launch, ncclkv.blend, ncclkv.cli; "
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    loaded = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert not loaded & set(OPTIONAL), f"import ncclkv loaded optional packages {sorted(loaded & set(OPTIONAL))}"
    assert {"torch", "zmq", "msgspec"} <= loaded
