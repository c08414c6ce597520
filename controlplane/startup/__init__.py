"""Start-up of ``burstgate serve``, ``demo`` and ``migrate``: the checks made
before anything is bound or written (``tls``, ``network``, ``database`` and
its schema), and every failure told in one line with an exit status per
class (``errors``, ``report``; docs/operating.md, "Start-up failures").

The submodules are imported by name (nothing here), so that the server's
start path can use ``errors`` and ``network`` without the CLI's imports."""
