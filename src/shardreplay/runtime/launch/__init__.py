"""The launch room: starting a training run's learner ranks (:func:`launcher.train`)."""
