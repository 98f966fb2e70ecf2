"""Miles' SGLang rollout engine: SGLang servers started as subprocesses, one per engine.

Importing this package imports no SGLang, no torch and no HTTP library: the servers run
``python -m sglang.launch_server`` in their own processes, on the machines where SGLang is
installed. The modules: ``options`` (the config model), ``command`` (the command line and
environment of engine ``i``), ``launcher`` (the processes), ``plugin`` (the registration).
"""
