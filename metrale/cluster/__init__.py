"""metrale on Ray Serve: N engine replicas behind one OpenAI-compatible ingress; docs/DESIGN.md
("The cluster") gives each file's concept. Nothing here is imported by the rest of metrale;
only router, replica, ingress and launch import Ray.
"""
