"""run_distributed's fork server imports this module alone, and it imports megatron.spawn.preload_names() with
the garbage collector off, then freezes what they made. With the collector on, importing torch, DeepSpeed and
transformers runs a full collection each time the heap grows by a quarter (measured: the preload took 5.9 CPU-s,
4.7 with it off). Frozen objects are never scanned again: not in the server, nor in the workers it forks, where a
scan writes to every inherited object and so copies its page."""
import gc

gc.disable()     # megatron.spawn (this package) imports no torch itself
try:
    from megatron.spawn import preload_names
    for name in preload_names():
        try:
            __import__(name)
        except ImportError:      # a reference library this machine lacks: as multiprocessing's own preload does
            pass
finally:
    gc.freeze()
    gc.enable()
