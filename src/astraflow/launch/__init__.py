"""`astraflow up` on one machine: the supervised children, their restart policy, the console, a recipe's
services and the members that start before the controller (launch/up.py is where to start reading)."""
