"""Code both services use: configuration, sampling parameters, Redis launcher, logging."""
