"""The IFRT proxy service: unmodified JAX programs (JAX_PLATFORMS=proxy) as clients of the cluster."""
