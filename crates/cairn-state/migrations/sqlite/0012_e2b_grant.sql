-- Revocable E2B access tokens.
--
-- `grant_token` is the id of the API token (`api_tokens.id`) that created
-- or last connected, resumed or paused the E2B sandbox. Its envd access
-- token is derived from the sandbox's id and this id, and is honoured only
-- while that API token exists: `cairn token rm` revokes every access token
-- it issued. NULL for sandboxes recorded before this column (their access
-- token is derived from the id alone until the next connect).
ALTER TABLE e2b_sandboxes ADD COLUMN grant_token TEXT;
