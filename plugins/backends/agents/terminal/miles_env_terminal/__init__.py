"""Miles terminal-use environment: a sandboxed shell (:mod:`.sandbox`), small coding tasks
graded by hidden tests (:mod:`.tasks`), the episode API an agent harness drives
(:mod:`.episode`) and the data source and reward registered with Miles (:mod:`.plugin`).

Nothing heavy is imported here: the jail imports this package for every command.
"""
