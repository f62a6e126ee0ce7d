"""Tooling around the library, not used by it: embedded S3 servers for demos and tests
(``embedded``), the ``ckptstore demo`` job (``demo``), the ``ckptstore bench`` comparison of a
store with raw writes (``store_bench``), and the timing harness the benchmarks share
(``timing``). Importing ``ckptstore`` never imports these."""
