"""Shared machinery of Miles's trainer backends (a library: it registers nothing).

Groups to padded tensors, the algorithm's ``TokenBatch`` and the micro-batch plan
(:mod:`.batch`), the learning-rate schedule (:mod:`.schedule`), the spawned worker processes
of a world size N > 1 and their pipe protocol (:mod:`.processes`), RNG states and tensor
hashes for checkpoints and fingerprints (:mod:`.state`), the response-token log-prob and
entropy gather (:mod:`.logprobs`), the shared-prompt layout (:mod:`.layout`), the options every
backend takes (:mod:`.options`), a rank's common steps (:mod:`.rank`), the rank itself written
once (:mod:`.worker`: a backend subclasses ``TrainerRank`` and supplies what differs), the
record of such a backend (:mod:`.record`) and the ``Trainer`` the loop talks to
(:mod:`.controller`). Importing the package imports no torch; its modules do (but
:mod:`.options` and :mod:`.record`).
"""
