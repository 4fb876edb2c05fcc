"""The answer on its way back to the client. ``relay`` sends it as a stream, whole, or assembled from
the child's stream (``assemble``), byte for byte where it can; ``formats`` names, per route, how its
stream is measured (``openai`` for ``data:`` events, ``events`` for typed ones) and how an error ends it
(``anthropic`` for the Messages routes' shape); ``privacy`` strips prompt-cache detail on the way."""
