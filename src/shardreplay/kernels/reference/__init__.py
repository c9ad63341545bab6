"""Plain-numpy references of the compiled kernels, one module per kernel module.

They follow each kernel's documented contract directly, without its speed tricks
(increment-and-wrap slots, incremental validity, level-by-level tree walks, raw
copies), and exist for the differential tests in tests/kernels/. The compiled gym
step write (``gym_step.gym_write``) has its reference above this layer instead:
``GymStepConverter`` followed by ``ReplayBuffer.add``, which
tests/gym/test_writer.py compares it with.
"""
