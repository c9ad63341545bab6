"""The learner room: one learner rank (:class:`loop.Learner`) and the parts it is built from."""
