"""The local stack: `molt up` starts every service as a local process and runs a recipe."""
