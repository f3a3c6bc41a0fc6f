"""Test-only fault injection (tests/test_server_faults.py and tests/test_pd_disagg.py put this
folder on PYTHONPATH for one server): in the engine-core process, a request whose stop strings
include CRASH_STOP raises an unexpected exception inside the core's loop, the way a bug would, so
that the test can check what the server shows of the traceback.

KV transfer: when KVTEST_KV_FAULTS names a JSON file, a prefill instance reads it before serving
each pull: {"delay_s": S} holds the answer S seconds (time for the test to kill or abort
something mid-transfer), {"fail_every": N} refuses every N-th pull as if the transfer broke.
Nothing else changes."""
import importlib.abc
import importlib.util
import json
import os
import sys
import time

CRASH_STOP = "kvflow-test: crash the engine core"


def _patch_agent(module):
    real = module.KVTransferAgent._serve_pull
    count = [0]

    def _serve_pull(self, router, ident, req):
        path = os.environ.get("KVTEST_KV_FAULTS")
        faults = {}
        if path and os.path.exists(path):
            with open(path) as f:
                faults = json.load(f)
        count[0] += 1
        if faults.get("delay_s"):
            time.sleep(faults["delay_s"])
        every = faults.get("fail_every")
        if every and count[0] % every == 0:
            header = module.m.KVHeader(req.transfer_id, "injected transfer fault")
            router.send_multipart([ident, module.m.KV, module.m.encoder.encode(header)])
            return None
        return real(self, router, ident, req)

    module.KVTransferAgent._serve_pull = _serve_pull


class _PatchKVAgent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "kvflow.kv_transfer.agent":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            _patch_agent(module)

        spec.loader.exec_module = exec_module
        return spec


class _PatchEngineCore(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "kvflow.engine.core":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            real = module.EngineCore.add_request

            def add_request(self, r):
                if r.sampling_params.stop and CRASH_STOP in r.sampling_params.stop:
                    raise ZeroDivisionError("injected fault in the engine core")
                return real(self, r)

            module.EngineCore.add_request = add_request

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchEngineCore())
sys.meta_path.insert(0, _PatchKVAgent())
