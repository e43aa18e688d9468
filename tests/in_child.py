"""Run one function of a test file in a process of its own (``helpers.in_child``).

    python tests/in_child.py TEST_FILE FUNCTION JSON_ARGS

For a test whose state must not stay in pytest's process: a torch.distributed process group, which a
DistributedDataParallel module keeps alive (gloo's threads, its store) after destroy_process_group.
Through helpers.rank_processes it is a fork of the forked-CLI server (fairseq imported, no thread).
An exception prints its traceback and exits 1.
"""

import importlib.util
import json
import sys

if __name__ == "__main__":
    path, function, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    spec = importlib.util.spec_from_file_location("in_child_test_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    getattr(module, function)(*args)
