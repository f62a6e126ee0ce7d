"""Models of storage the suite runs the protocol on: a simulated file system that records
every change and materialises what a power loss may leave (``simfs``)."""
