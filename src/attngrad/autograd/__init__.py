"""The derivatives every strategy shares: first-order gradients as a Function, second order, tangents, vmap."""
