"""What expanded code imports: process groups, collectives, buckets, kernels glue.

One concept per module; each is small and readable, because users step into it.
"""
