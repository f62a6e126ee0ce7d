"""The layers of the suite, one module each, and what they share (the standard workload,
the crash cases); ``registry`` lists them in the order they run."""
