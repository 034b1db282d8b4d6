"""How a failed contender's error reads in the bench's rows: a peer's DataLoader that runs out of a
container's /dev/shm (real: a mount namespace whose /dev/shm is a 4 MB tmpfs) names it and the fix."""

from __future__ import annotations

import textwrap

from helpers.small_shm import mount_line, run_in_namespace

from medload.bench.common import error_text

_SCRIPT = mount_line("4m") + textwrap.dedent("""
    import torch
    from medload.bench.common import error_text

    class Big(torch.utils.data.Dataset):  # a stock dataset: each sample a new 8 MB tensor, as MONAI's are
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return torch.zeros(2 << 20)

    try:
        next(iter(torch.utils.data.DataLoader(Big(), batch_size=1, num_workers=1)))
    except Exception as exc:
        print(error_text(exc))
""")


def test_a_worker_out_of_shared_memory_is_one_line_with_the_size_and_the_fix():
    out = run_in_namespace(_SCRIPT)
    assert out.returncode == 0, out.stderr[-3000:]
    line = out.stdout.strip()
    assert len(line.splitlines()) == 1, line  # not the worker's whole traceback
    assert "unable to allocate shared memory" in line and "/dev/shm is 4 MiB" in line and "--shm-size" in line


def test_other_errors_keep_their_whole_text():
    exc = RuntimeError("Caught ValueError in DataLoader worker process 0.\nOriginal Traceback:\nValueError: bad")
    assert error_text(exc) == f"RuntimeError: {exc}"
