"""Built-in backends, one module per storage system; each exposes ``open_<name>(url, options)``.

Modules are imported lazily by ``ckptstore.registry`` so that a missing optional dependency
(boto3 for s3://) only matters to the scheme that needs it.
"""
