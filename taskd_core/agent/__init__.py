"""The node agent: supervises one node's workers through an adapter and carries out the controller's actions."""
