"""``init_process_group`` and ``end_process_group``: a rank's gloo group ends, worker threads and
all, while Python is alive, even when its DDP wrapper (the process's first) was left in a
reference cycle (fused_optim/process_group.py says why no gloo thread may outlive Python)."""

import json
import subprocess
import sys

RANK = '''
import glob, json, sys, types
import torch, torch.distributed as dist
from fused_optim.process_group import end_process_group, init_process_group

def gloo_threads():  # the names torch gives them: pt_gloo_runloop (workers), gloo_tcp_loop
    return sorted(n for n in (open(t + "/comm").read().strip() for t in glob.glob("/proc/self/task/*")) if "gloo" in n)

init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
runner = types.SimpleNamespace(model=torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 1)))
runner.self = runner  # a training loop's objects in a reference cycle (mmengine's Runner)
runner.model(torch.ones(2, 3)).sum().backward()
dist.all_reduce(torch.ones(1))
before = gloo_threads()
del runner
end_process_group()
print(json.dumps(dict(before=before, after=gloo_threads(), initialized=dist.is_initialized())))
end_process_group()  # nothing left to end
'''


def test_end_process_group_joins_the_gloo_threads_of_a_group_a_cycle_held(tmp_path):
    out = subprocess.run([sys.executable, "-c", RANK, str(tmp_path / "store")], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    threads = json.loads(out.stdout.splitlines()[-1])
    assert "pt_gloo_runloop" in threads["before"]  # the group had its workers
    assert threads["after"] == [] and threads["initialized"] is False
