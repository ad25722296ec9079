"""A stand-in for torch_memory_saver after 0.0.10: `register_hook_mode(name, factory,
uses_preload=...)` and `hook_mode = name` pick the implementation."""

_modes = {}


def register_hook_mode(name, factory, uses_preload=True):
    _modes[name] = (factory, uses_preload)


class TorchMemorySaver:
    def __init__(self):
        self._impl = None
        self._mode = "preload"

    @property
    def hook_mode(self):
        raise AttributeError

    @hook_mode.setter
    def hook_mode(self, mode):
        self._mode = mode

    def _ensure_initialized(self):
        if self._impl is None:
            self._impl = _modes[self._mode][0]()

    def region(self, tag="default", enable_cpu_backup=False):
        self._ensure_initialized()
        return self._impl.region(tag=tag, enable_cpu_backup=enable_cpu_backup)

    def pause(self, tag=None):
        self._ensure_initialized()
        self._impl.pause(tag=tag)

    def resume(self, tag=None):
        self._ensure_initialized()
        self._impl.resume(tag=tag)


torch_memory_saver = TorchMemorySaver()
