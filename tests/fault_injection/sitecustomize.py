"""Test-only fault injection (tests/test_server_faults.py puts this folder on PYTHONPATH for one
server): in the engine-core process, a request whose stop strings include CRASH_STOP raises an
unexpected exception inside the core's loop, the way a bug would, so that the test can check
what the server shows of the traceback. Nothing else changes."""
import importlib.abc
import importlib.util
import sys

CRASH_STOP = "kvflow-test: crash the engine core"


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
