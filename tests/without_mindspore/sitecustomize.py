"""On PYTHONPATH, makes `import mindspore` fail, as on a machine without it: the fast tier
(`make test-fast`) must pass so (`make test` runs it so)."""
import sys


class _NoMindSpore:
    def find_spec(self, name, path=None, target=None):
        if name == "mindspore" or name.startswith("mindspore."):
            raise ImportError("mindspore is not importable here (tests/without_mindspore)")
        return None


sys.meta_path.insert(0, _NoMindSpore())
