"""YAML to frozen objects, every error by its path; the proxy's settings and a reload's diff derive from
them."""
