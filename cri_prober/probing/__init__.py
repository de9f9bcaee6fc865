"""The probing layer: probe specs, the four handlers, the prober that dispatches to them, the
per-probe worker (the kubelet's doProbe loop) and the results store.

It knows containers only through what discovery reports, and describes what it reads of them
(and of an ExecSync answer) in its own types: it imports neither discovery nor the runtime, and
never the manager, serving or the CLI.
"""
