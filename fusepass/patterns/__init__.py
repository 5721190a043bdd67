"""Built-in rewrite rules, one file per rule; see fusepass.rule for the API."""
