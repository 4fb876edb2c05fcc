// The conversation id of a request, for nginx's consistent hash (deploy/nginx/llamagate.conf): the same
// id llamagate derives itself (proxy/conversations/key.py), as docs/api.md "Conversations" specifies,
// so a conversation's turns reach the replica whose llama-server holds its state. The first present:
//   1. the X-Session-Id header                       -> "session:" + value
//   2. the body's prompt_cache_key                   -> "prompt_cache_key:" + value
//   3. the x-claude-code-session-id or session-id header -> "agent:" + value
//   4. the opening: sha256 hex of len(S) ":" S len(U) ":" U, S the system text, U the first user
//      message's text, lengths in UTF-8 bytes         -> "opening:" + digest
// "" when the request has none (a raw prompt, a body that is not JSON): nginx then balances it
// without a hash. Needs Debian's libnginx-mod-http-js (njs); tests/unit/proxy/conversations and
// tests/integration/test_conversations_nginx.py hold this file to the Python one.

var crypto = require('crypto');

var MAX_ID_CHARS = 256;

function plainId(value) {
    if (typeof value !== 'string') {
        return null;
    }
    var text = value.trim();
    return text.length > 0 && text.length <= MAX_ID_CHARS ? text : null;
}

function content(value) {
    if (typeof value === 'string') {
        return value;
    }
    if (Array.isArray(value)) {
        var parts = [];
        for (var i = 0; i < value.length; i++) {
            var part = value[i];
            if (part !== null && typeof part === 'object' && typeof part.text === 'string') {
                parts.push(part.text);
            }
        }
        return parts.join('\n');
    }
    return '';
}

// [system texts, first user text] of a list of messages (chat, Anthropic) or of Responses' input items;
// null when an item is not an object.
function scan(items, system) {
    for (var i = 0; i < items.length; i++) {
        var item = items[i];
        if (item === null || typeof item !== 'object' || Array.isArray(item)) {
            return null;
        }
        if (item.role === 'system' || item.role === 'developer') {
            system.push(content(item.content));
        } else if (item.role === 'user') {
            return content(item.content);
        }
    }
    return '';
}

function opening(body) {
    var system = [];
    var user = null;
    if (Array.isArray(body.messages)) {
        system.push(content(body.system));
        user = scan(body.messages, system);
    } else {
        system.push(content(body.instructions));
        if (typeof body.input === 'string') {
            user = body.input;
        } else if (Array.isArray(body.input)) {
            user = scan(body.input, system);
        }
    }
    if (!user) {
        return null;
    }
    var head = system.filter(function (s) { return s.length > 0; }).join('\n');
    var text = Buffer.byteLength(head) + ':' + head + Buffer.byteLength(user) + ':' + user;
    return crypto.createHash('sha256').update(text).digest('hex');
}

function id(r) {
    var session = plainId(r.headersIn['X-Session-Id']);
    if (session !== null) {
        return 'session:' + session;
    }
    var agent = plainId(r.headersIn['x-claude-code-session-id']);
    if (agent === null) {
        agent = plainId(r.headersIn['session-id']);
    }
    var body = null;
    try {
        body = JSON.parse(r.variables.request_body || '');
    } catch (e) {
        body = null;
    }
    if (body === null || typeof body !== 'object' || Array.isArray(body)) {
        return agent !== null ? 'agent:' + agent : '';
    }
    var key = body.prompt_cache_key;
    if (typeof key === 'string' && key.length > 0 && key.length <= MAX_ID_CHARS) {
        return 'prompt_cache_key:' + key;
    }
    if (agent !== null) {
        return 'agent:' + agent;
    }
    var digest = opening(body);
    return digest === null ? '' : 'opening:' + digest;
}

export default { id };
