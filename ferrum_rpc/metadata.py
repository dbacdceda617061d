"""The gRPC metadata keys the contract defines (server and clients read these names)."""

DEADLINE_HEADER = "ferrum-deadline-unix-ns"  # optional: the caller's absolute deadline, wall-clock ns
TICKET_HEADER = "ferrum-import-ticket"  # ImportSequence with a ticket: a push from another server
TENANT_HEADER = "ferrum-import-tenant"  # the tenant the pushing server's caller is (the ticket must be theirs)
