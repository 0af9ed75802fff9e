"""The node agent: supervises one node's workers through an adapter, carries out the controller's actions."""
