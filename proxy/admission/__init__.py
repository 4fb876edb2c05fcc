"""How many slots, for whom and when: every 429, and the 400 for a request wider than it could ever be
granted. ``cost`` says what a request occupies (and applies the tenant's bounds to its body), ``gate``
grants slot permits fairly per tenant, ``totals`` bounds a tenant across every model, ``count_rate`` is
the token bucket of the counting routes, ``settle`` keeps an abandoned request's slots counted until the
child has let them go, ``idle`` waits for "nothing left"."""
