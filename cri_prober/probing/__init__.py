"""The probing layer: probe specs, the four handlers, the prober that dispatches to them, the
per-probe worker (the kubelet's doProbe loop) and the results store.

It knows containers only through what discovery reports and never imports the manager, serving or
the CLI.
"""
