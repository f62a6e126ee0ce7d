"""Tracing the real driver's system calls (strace), in a traced child process, and replaying
the trace into a simulated file system; file-system images on loop devices. Used by the
syscall-trace layer (``layers.syscall_trace``)."""
