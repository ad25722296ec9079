"""A stand-in for torch_memory_saver 0.0.10: a facade singleton that delegates to the
implementation object it makes on first use (`_impl`), and no extension point."""


class TorchMemorySaver:
    def __init__(self):
        self._impl = None

    def _ensure_initialized(self):
        if self._impl is None:
            raise RuntimeError("the stand-in has no implementation of its own")

    def region(self, tag="default", enable_cpu_backup=False, enable_disk_backup=False,
               cpu_backup_backend=None):
        self._ensure_initialized()
        return self._impl.region(tag=tag, enable_cpu_backup=enable_cpu_backup,
                                 enable_disk_backup=enable_disk_backup,
                                 cpu_backup_backend=cpu_backup_backend)

    def pause(self, tag=None):
        self._ensure_initialized()
        self._impl.pause(tag=tag)

    def resume(self, tag=None):
        self._ensure_initialized()
        self._impl.resume(tag=tag)


torch_memory_saver = TorchMemorySaver()
