import sys, types, importlib.abc, importlib.machinery
__version__ = "0.26.0"
class _Any:
    def __init__(self, *a, **k): pass
    def __call__(self, *a, **k): return _Any()
    def __getattr__(self, n): return _Any()
    def __mro_entries__(self, bases): return (object,)
class _StubMod(types.ModuleType):
    def __getattr__(self, n):
        if n.startswith("__"): raise AttributeError(n)
        return _Any()
class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
    def create_module(self, spec): return _StubMod(spec.name)
    def exec_module(self, m): m.__path__ = []
sys.meta_path.insert(0, _Finder())
