"""The door's declared request schema: what each route's body may hold, checked before admission.

llama-server validates little and trusts its caller (the pinned server aborts on a grammar trigger of an
unknown type, answers 500 to an out-of-vocabulary token id); the door is where hostile input stops. For
every route the proxy serves with a body, each field it accepts is declared once: its JSON type and range
(from the pinned server's own schema, its hard limits, the model's vocabulary and the tenant's bounds)
and which keys may send it. A field of the wrong type or out of range is a 400 naming it (``param``), in
the route's own error shape; an undeclared field is refused by default.

- ``values``: the kinds a value may be (integer in a range, string, array of..., token id), each
  variable-size one with its most (``Size``: characters, elements, members), a tenant's
  ``field_bounds`` replacing it by name;
- ``costs``: what a unit of a costly value holds the child's server loop for, measured; the default
  bounds of those values are computed from it and the model's vocabulary, within a 1 s budget;
- ``fields``: a declared field (value, doc, who may send it, its roles: token cap, n, prompt...);
- ``llama``: the pinned server's ``server-schema.cpp``, field by field;
- ``programs``: the programs inside strings (a GBNF grammar, a JSON schema, a trigger pattern), read as
  the child reads them and bounded in what they cost it;
- ``media``: media parts and ``/infill`` against what the loaded model takes (read from it at load);
- ``routes``: each route's fields (``SCHEMAS``), dialects included;
- ``bounds``: the tenant's bounds that rewrite instead of refusing (token cap, prompt cache);
- ``reference``: docs tables made from the schema, and the walk that finds every size bound;
- ``check``: ``check_request`` (``check_body`` with the request's bounds), the one call, made once per
  request by the endpoint before admission.
"""

from proxy.schema.check import check_body, check_request, declared
from proxy.schema.values import Context, FieldError, UnknownField
from proxy.settings import UnknownPolicy

__all__ = [
    "Context",
    "FieldError",
    "UnknownField",
    "UnknownPolicy",
    "check_body",
    "check_request",
    "declared",
]
