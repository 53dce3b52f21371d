"""A job relaunched on another number of processes restores from its surviving agents and
parity, never from storage, though storage holds the step too.

Machines are run roots and loopback addresses of their own (nothing shared between them);
which machine runs which process index is the launcher's choice, and changes at each
relaunch. One chain reuses the machines' agents across the cases: a 4-process job saves;
machine 1 is lost for good, and the job comes back on 3 processes, then on 2 (a surviving
machine left out of the job: its agent still serves), then grows back to 4 (two new
machines). :mod:`tests.support.resize_worker` runs each process's side.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxckpt.agent.commands import jobs
from jaxckpt.agent.trainer._factory import choose_agents
from jaxckpt.testing import processes
from tests.support import resize_worker
from tests.support.resize_worker import finish, lose, machine, said

ROWS, COLS = 48, 64


def launch(machines: list[int], root: str, job: str, directory: str, *args: str):
  return resize_worker.launch(machines, root, job, directory, "--rows", str(ROWS), "--cols",
                              str(COLS), *args)


def agents_on(root: str, job: str, machines: list[int]) -> dict[int, int]:
  """How many live agents of the job each machine runs."""
  return {m: len(jobs.job_agents(machine(root, m)[0], job)) for m in machines}


def served(root: str, job: str, m: int) -> int:
  """What machine ``m``'s agents have sent other processes, as its `jaxckpt status` says."""
  return sum(a.served_bytes for a in jobs.job_status(machine(root, m)[0], job).agents if a.local)


# -- what each process needs: the saved shards its devices' regions overlap -------------------

def boxes(n: int) -> dict[str, list[list[tuple[int, int]]]]:
  """Each process's device regions of every leaf, in a job of ``n`` processes of 2 devices."""
  d = 2 * n
  rows = [(ROWS * i // d, ROWS * (i + 1) // d) for i in range(d)]
  cols = [(ROWS * i // d, ROWS * (i + 1) // d) for i in range(d)]
  full = {"w": [(0, ROWS), (0, COLS)], "u": [(0, COLS // 4), (0, ROWS)], "rep": [(0, 7)]}
  out = {}
  for p in range(n):
    out[p] = {"w": [[rows[2 * p + j], full["w"][1]] for j in (0, 1)],
              "u": [[full["u"][0], cols[2 * p + j]] for j in (0, 1)],
              "rep": [full["rep"]]}
  return out


def shard_bytes(leaf: str, box: list[tuple[int, int]]) -> int:
  return int(np.prod([b - a for a, b in box])) * 4


def needed_from(old: int, new: int, h: int, p: int) -> int:
  """Bytes of old process ``h``'s shards that new process ``p``'s regions overlap (a shard is
  read whole: it is the unit of verification; a replicated leaf is saved by process 0)."""
  total = 0
  for leaf, mine in boxes(old)[h].items():
    if leaf == "rep" and h != 0:
      continue
    for shard in mine:
      if any(all(a < d and c < b for (a, b), (c, d) in zip(shard, want))
             for want in boxes(new)[p][leaf]):
        total += shard_bytes(leaf, shard)
  return total


def snapshot_bytes(old: int, h: int) -> int:
  return sum(shard_bytes(leaf, s) for leaf, mine in boxes(old)[h].items()
             if leaf != "rep" or h == 0 for s in mine)


def relaunched(root: str, job: str, directory: str, order: list[int], step: int, tier: str,
               save: int | None = None) -> dict[int, str]:
  """Process i of a relaunched job on machine ``order[i]`` restores ``step`` from ``tier``
  bit for bit (then saves and protects ``save``), each machine running one agent:
  each process's output, by machine."""
  args = ["--phase", "relaunch"] + ([] if save is None else ["--save", str(save)])
  with launch(order, root, job, directory, *args) as procs:
    outs = finish(procs)
  for p, out in enumerate(outs):
    (got, got_tier, ok, _, _), = said(out, "RESTORED")
    assert (got, got_tier, ok) == (str(step), tier, "ok"), (p, out[-3000:])
    assert said(out, "PROTECTED") == ([] if save is None else [[str(save)]])
  # each machine's process kept the agent there: no second one took its memory
  assert agents_on(root, job, order) == {m: 1 for m in order}
  return dict(zip(order, outs))


def sent(out: str) -> int:
  """What the process's machine's agent sent other processes during the restore."""
  before, after = said(out, "SERVED")
  return int(after[0]) - int(before[0])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_job_shrinks_and_grows_restoring_from_its_surviving_agents(tmp_path):
  directory = str(tmp_path / "ckpt")
  with processes.agent_sandbox("jr") as (root, job):
    with launch([0, 1, 2, 3], root, job, directory, "--phase", "save", "--steps", "1", "2"
                ) as procs:
      for out in finish(procs):
        assert said(out, "SAVED") == [["2"]]

    # 4 -> 3: machine 1 is lost for good, no spare; every survivor gets another index.
    lose(root, 1)
    order = [2, 3, 0]
    outs = relaunched(root, job, directory, order, 2, "parity")
    # Each survivor sends the shards of its own that a process on another machine needs
    # (each once to each), and for the lost host's shards a process needs, the same
    # ranges of the one piece of each of their stripes it holds: at most a byte for each
    # byte rebuilt (a whole-host rebuild on every process sent 15,552, 15,360 and 13,908).
    lost_needed = sum(needed_from(4, 3, 1, p) for p in range(3))
    for m in order:
      own = sum(needed_from(4, 3, m, p) for p, q in enumerate(order) if q != m)
      assert own <= sent(outs[m]) <= own + lost_needed, (m, sent(outs[m]), own, lost_needed)

    # 4 -> 2: machine 0 is left out of the job (its agent still up); it serves its piece.
    before = served(root, job, 0)
    relaunched(root, job, directory, [3, 2], 2, "parity", save=3)
    own = sum(needed_from(4, 2, 0, p) for p in range(2))
    lost_needed = sum(needed_from(4, 2, 1, p) for p in range(2))
    assert own <= served(root, job, 0) - before <= own + lost_needed

    # 2 -> 4: two new machines; the two that hold step 3 run other indices than they saved.
    order = [2, 4, 3, 5]
    outs = relaunched(root, job, directory, order, 3, "host", save=4)
    for m, h in {3: 0, 2: 1}.items():         # machine -> its process in the 2-process job
      want = sum(needed_from(2, 4, h, p) for p, q in enumerate(order) if q != m)
      assert sent(outs[m]) == want, (m, sent(outs[m]), want)


def _said(*machines, fixed=None):
  """What each process says of its machine: the (host id, address) of the agents there."""
  return [{"fixed": None if fixed is None else fixed[p], "here": [list(a) for a in m]}
          for p, m in enumerate(machines)]


@pytest.mark.parametrize("said, want", [
    # a new job: no agents anywhere, each names its own
    (_said([], [], []), [0, 1, 2]),
    # relaunched in the same order: each keeps the agent named for it
    (_said([(0, "a")], [(1, "b")]), [0, 1]),
    # 4 -> 3 on machines 2, 3, 0: each keeps its machine's agent, whatever index it served
    (_said([(2, "c")], [(3, "d")], [(0, "a")]), [2, 3, 0]),
    # 2 -> 4 on machines 1, new, 0, new: new machines' agents are named for their index
    (_said([(1, "b")], [], [(0, "a")], []), [1, 1, 0, 3]),
    # one machine of several processes (a shared run root): an agent every process sees is
    # nobody's to take over; the one named for a process is still its own
    (_said(*[[(0, "a"), (1, "b"), (3, "d")]] * 3), [0, 1, 2]),
    # a machine with two agents of the job: which one is ambiguous, so a new one
    (_said([(0, "a")], [(2, "c"), (3, "d")]), [0, 1]),
    # AgentOptions.host_id wins, and its agent is nobody else's
    (_said([(5, "e")], [(5, "e")], fixed=[5, None]), [5, 1]),
])
def test_each_process_keeps_its_machines_agent_when_no_other_process_sees_it(said, want):
  assert choose_agents(said) == want
