"""Both host stores keep the shipped HostStore contract."""

from __future__ import annotations

import contextlib

import pytest

import jaxckpt as jc
from jaxckpt.agent.trainer.client import AgentStore
from jaxckpt.host.store import InProcessStore
from jaxckpt.testing import processes
from jaxckpt.testing.host_store import HostStoreContract


class TestInProcessStore(HostStoreContract):

  @pytest.fixture
  def make_store(self):
    stores = []

    def make(max_snapshots, limit_bytes):
      stores.append(InProcessStore(max_snapshots=max_snapshots,
                                   host_memory_limit_bytes=limit_bytes))
      return stores[-1]
    yield make
    for s in stores:
      s.close()


class TestAgentStore(HostStoreContract):

  @pytest.fixture
  def make_store(self):
    with contextlib.ExitStack() as stack:
      def make(max_snapshots, limit_bytes):
        root, job = stack.enter_context(processes.agent_sandbox())
        store = AgentStore(jc.AgentOptions(job_name=job, run_root=root), host=0,
                           max_snapshots=max_snapshots, limit_bytes=limit_bytes)
        stack.callback(store.close)
        return store
      yield make
