"""One request's way through the gateway: parse → prepare → place → execute → relay →
finish, one record per request."""
