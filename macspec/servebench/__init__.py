"""`macspec bench`: scenarios against a server, and the report users already write by hand."""
